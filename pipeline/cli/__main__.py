"""``python -m pipeline.cli``: the command line, as ``python -m pipeline`` starts it."""

from pipeline.cli.launch import main

if __name__ == "__main__":
    main()
