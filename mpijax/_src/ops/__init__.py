"""mpijax's MPI primitives (layer 3): one module per primitive."""
