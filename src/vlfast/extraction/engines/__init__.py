"""Where the work runs: this process and its ranks, or Ray Data."""
