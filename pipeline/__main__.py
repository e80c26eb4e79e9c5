"""``python -m pipeline``: the ``score-catalog`` command, started as the console script starts it
(:mod:`pipeline.launch`: SIGTERM and SIGINT are handled before anything else is imported)."""

from pipeline.launch import main

if __name__ == "__main__":
    main()
