"""Whole models: how much faster and how accurate is a converted model than bf16/fp32 and peers?"""
