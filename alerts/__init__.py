"""The alert rules' sources (rules.py) and their generator (generate.py); not part of the
installed package."""
