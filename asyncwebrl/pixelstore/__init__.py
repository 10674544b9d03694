"""pixelstore"""
