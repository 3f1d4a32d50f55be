"""The Postgres conversation store, built from the log: schema, migrations, projector."""
