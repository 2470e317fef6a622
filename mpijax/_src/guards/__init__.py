"""mpijax's guards: the stall inspector, the watch on ranks that never reach init(), abort on an uncaught exception."""
