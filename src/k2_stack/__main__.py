"""`python -m k2_stack ...` / `torchrun -m k2_stack ...` run the `k2` command."""

from k2_stack.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
