"""The placement policy names that are needed without loading the policies (which load numpy): the
default and its alias, for the command line's option defaults. `core.policies` defines the policies
under these names."""

from __future__ import annotations

from typing import Final

DEFAULT: Final = "fgd-lp"
"""The extender's policy unless told otherwise; the name `default` stands for it wherever a policy is named."""
ALIASES: Final = {"default": DEFAULT}
