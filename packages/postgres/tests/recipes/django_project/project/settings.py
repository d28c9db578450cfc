"""A minimal real Django project for the queue recipe (test_queue_recipes.py runs it).

The database is the test server (STEEPLE_DATABASE_URL) through Django's own PostgreSQL
backend on psycopg 3, with the test's schema first on the search path.
"""

import os

from psycopg.conninfo import conninfo_to_dict

STEEPLE_QUEUE_SCHEMA = os.environ["STEEPLE_QUEUE_SCHEMA"]
_db = conninfo_to_dict(os.environ["STEEPLE_DATABASE_URL"])

SECRET_KEY = "recipe-test-only"  # a throwaway project
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
USE_TZ = True
INSTALLED_APPS = ["shop"]
ROOT_URLCONF = "shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", ""),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        "OPTIONS": {"options": f"-c search_path={STEEPLE_QUEUE_SCHEMA}"},
    }
}
