"""The engine loop: requests in, one step at a time (schedule -> forward -> sample -> outputs), results out; and the thread that hosts it."""
