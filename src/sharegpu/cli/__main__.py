"""`python -m sharegpu.cli`, as `sharegpu`."""

from sharegpu.cli import main

main()
