"""Configuration: schema dataclasses, ConfigStore registration, validation, legacy environment variables."""
