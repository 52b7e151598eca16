"""CLI subcommands; see epqlab/cli.py."""
