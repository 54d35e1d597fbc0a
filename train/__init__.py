"""Training scripts for the small target + drafter pair shipped in ``pair/``."""
