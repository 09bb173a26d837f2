"""Worked solutions of the labs, one file per lab named after it: imports and the function, ready for a cell."""
