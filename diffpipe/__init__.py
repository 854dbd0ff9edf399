"""diffpipe: a Snakemake-first toolkit for fine-tuning diffusion models."""

__version__ = "0.1.0"
