"""The conversions, one module per command (``to_universal``, ``from_universal``, ``export_hf``,
``import_hf``): each plans from the source's metadata and hands the plan, as a
:class:`converter.run.pipeline.Conversion`, to the one pipeline. Commands never import each other."""
