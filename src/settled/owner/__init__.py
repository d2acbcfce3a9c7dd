"""The session owner: one small supervisor process per session (see main.py and launcher.py)."""
