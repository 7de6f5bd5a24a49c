"""This computer: the instance file, private user files, logs, native libraries and the
admin token's file. Imports nothing above the basics, so every layer may use it."""
