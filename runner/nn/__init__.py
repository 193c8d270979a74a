"""Layer kinds for the runner's architectures, one per module (STYLE.md habit 1)."""
