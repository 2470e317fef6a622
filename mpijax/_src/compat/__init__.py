"""Other libraries' APIs on mpijax's transport (see mpijax.compat)."""
