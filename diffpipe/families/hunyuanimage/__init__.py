"""HunyuanImage 2.1: not a registered family yet (see ``diffpipe.families.UNREGISTERED``)."""
