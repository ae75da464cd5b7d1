"""select"""
