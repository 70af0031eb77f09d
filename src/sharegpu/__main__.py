"""`python -m sharegpu` runs the command line."""

from sharegpu.cli import main

main()
