"""XLA's side: its collectives over MPI, and what mpijax does with every program JAX compiles."""
