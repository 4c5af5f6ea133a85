"""What several scripts share: launching runs (launch), their comparison (comparison), one
training step of a built run (steps). A package of its own because every scripts/*.py is a
command line (tests/test_scripts.py asks each for --help) and these modules are not.
"""
