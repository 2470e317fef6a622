"""The jax.lax-shaped collectives over named axes that span ranks."""
