"""The numerics version. Bump it on purpose whenever any op's bits change, and add a
line to the changelog in NUMERICS.md; the golden-vector test fails until you do."""

__version__ = "0.3.3"
