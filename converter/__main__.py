"""``python -m converter ...`` is the ``ckptconv`` command."""

from converter.cli import main

if __name__ == "__main__":
    main()
