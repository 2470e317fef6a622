"""Meshes over ranks and devices, the maps over them, and global arrays."""
