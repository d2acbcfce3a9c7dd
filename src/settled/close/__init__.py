"""The close join (rule 5): decide.py holds the pure decisions, join.py performs them."""
