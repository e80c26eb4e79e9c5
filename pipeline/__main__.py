"""``python -m pipeline``: the ``score-catalog`` command, started as the console script starts it
(:mod:`pipeline.cli.launch`: SIGTERM and SIGINT are handled before anything else is imported)."""

from pipeline.cli.launch import main

if __name__ == "__main__":
    main()
