"""Exercise checkers, one module per notebook: each computes the expected answer itself, so a student's cell shows only the call."""
