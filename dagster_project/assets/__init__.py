"""One module per stage; each holds its asset(s) and the checks that sit beside them."""
