"""Datasets: discovery, captions and metadata, checks and policy, validation, the manifest and its report."""
