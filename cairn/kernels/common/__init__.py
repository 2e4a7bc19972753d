"""What every op folder shares, and nothing op-specific: `checks` (argument checks, one error
format), `dispatch` (which implementation runs an op), `native` (building and loading the C++
library, over `native.h`), `varlen_plan` (a step's host-side launch tables) and `triton_helpers`
(autotuning and small helpers of the Triton kernels). Op folders import from here, never from
each other."""
