"""entrypoints"""
