"""Launch shape of the Triton slot copy (state/triton_ops.py): elements of one slot per program."""

BLOCK = 1024
