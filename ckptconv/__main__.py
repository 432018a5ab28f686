"""``python -m ckptconv ...`` is the ``ckptconv`` command (same entry point as the script)."""

from converter.cli import main

if __name__ == "__main__":
    main()
