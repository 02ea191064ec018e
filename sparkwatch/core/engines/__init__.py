"""What runs: which processes are engines, their command lines and trees, their compilers and JIT builds."""
