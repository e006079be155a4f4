"""`python -m gymproxy` runs the command line."""

from .cli import main

main()
