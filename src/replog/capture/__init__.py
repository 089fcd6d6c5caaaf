"""Change-data capture from databases straight into a log (``replog capture``).

Needs the ``postgres`` extra (psycopg); nothing else in replog imports this package.
"""
