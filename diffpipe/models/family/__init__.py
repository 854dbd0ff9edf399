"""The parts :class:`diffpipe.models.base.Family` is composed of, one module each (see that module's
docstring for which part holds what); import the family interface from ``diffpipe.models.base``."""
