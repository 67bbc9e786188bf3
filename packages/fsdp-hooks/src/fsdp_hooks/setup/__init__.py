"""Wrap-time work: validation, failure-atomic rollback, meta-device initialisation."""
