"""`python -m pagedllm ...`: the same as the `pagedllm` command (`pagedllm/cli.py`).

Owns nothing but this entry point.
"""

from pagedllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
