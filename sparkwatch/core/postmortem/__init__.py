"""How the previous boot ended: the flight recorder's samples and the verdict over them."""
