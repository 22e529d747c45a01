#!/bin/sh
# Create the user pods run as: moeloop, uid 1000, gid 1000 (the pods' securityContext names these ids).
# Ubuntu 24.04 based images (CUDA, vLLM) already have a user `ubuntu` with uid/gid 1000: it is removed first.
set -eu
existing_user=$(getent passwd 1000 | cut -d: -f1 || true)
if [ -n "$existing_user" ] && [ "$existing_user" != moeloop ]; then userdel --remove "$existing_user" 2>/dev/null || userdel "$existing_user"; fi
existing_group=$(getent group 1000 | cut -d: -f1 || true)
if [ -n "$existing_group" ] && [ "$existing_group" != moeloop ]; then groupdel "$existing_group"; fi
groupadd --gid 1000 moeloop
useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash moeloop
