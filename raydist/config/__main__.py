"""`python -m raydist.config`: prints the README's config reference (regenerate it after changing a field)."""

from raydist.config.io import reference_markdown

print(reference_markdown())
