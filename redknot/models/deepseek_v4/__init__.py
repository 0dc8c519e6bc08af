"""models/deepseek_v4"""
