"""Generated code (make gen): never edit by hand."""
