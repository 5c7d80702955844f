"""The live dashboard: one JSON view of the pools (``view``) and the routes that serve it with
its static page (``routes``).
"""
