"""step"""
