"""On-disk formats: one module per format, each with the same reader shape (see ``base``).

This package never imports ``converter``.
"""
