"""Support code for the tests: random-weight models and other fixtures that are not the product."""
