; vramguard per-user installer (no administrator rights needed).
; Compiled by installer/build_installer.py, which generates the included file lists
; (in ${GEN}) from the PyInstaller bundle and passes VERSION, OUTFILE, EXE_CONSOLE,
; EXE_DESKTOP, SIZE_KB and COMPRESSOR. NSIS cannot hold much more than 2 GB, so the
; bundle is split: this setup carries the first part and runs the other parts
; (vramguard-<version>-setup.partN.exe, shipped beside it) silently into the same folder.
;
; Silent use:  setup.exe /S [/AUTOSTART] [/D=folder]
;              uninstall.exe /S [/REMOVEDATA]   (default: keep settings, cache and logs)

Unicode true
Target amd64-unicode
!if "${COMPRESSOR}" == "none"
  SetCompress off
!else
  SetCompressor /SOLID ${COMPRESSOR}
!endif
CRCCheck force

!include MUI2.nsh
!include FileFunc.nsh
!include LogicLib.nsh
!include Sections.nsh

!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\vramguard"
!define RUN_KEY "Software\Microsoft\Windows\CurrentVersion\Run"
!define DATA_DIR "$LOCALAPPDATA\vramguard"
!define SHORTCUT "$SMPROGRAMS\vramguard.lnk"

Name "vramguard ${VERSION}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\Programs\vramguard"
InstallDirRegKey HKCU "${UNINST_KEY}" "InstallLocation"
RequestExecutionLevel user
ShowInstDetails show
ShowUninstDetails show
!ifdef ICON
  !define MUI_ICON "${ICON}"
  !define MUI_UNICON "${ICON}"
!endif

!define MUI_COMPONENTSPAGE_NODESC
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_INSTFILES
!define MUI_FINISHPAGE_RUN "$INSTDIR\${EXE_DESKTOP}"
!define MUI_FINISHPAGE_RUN_TEXT "Start vramguard now"
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

; Stop a running vramguard so its files can be replaced or removed. Nothing to stop,
; or no old copy to ask, is fine.
!macro StopRunning
  ${If} ${FileExists} "$INSTDIR\${EXE_CONSOLE}"
    DetailPrint "Stopping vramguard if it is running..."
    nsExec::ExecToLog '"$INSTDIR\${EXE_CONSOLE}" stop --timeout-s 30'
    Pop $0
  ${EndIf}
!macroend

; Remove exactly the files this version installed (never RMDir /r on a folder the user
; chose: it may hold other things), then the folders left empty.
!macro RemoveInstalledFiles
  !include "${GEN}/remove-files.nsh"
!macroend

Function RemoveInstalled
  !insertmacro RemoveInstalledFiles
FunctionEnd

Function un.RemoveInstalled
  !insertmacro RemoveInstalledFiles
FunctionEnd

; Runs one part installer from the setup's own folder; on any failure, undo and stop.
!macro InstallPart FILE NUMBER COUNT SIZE
  ${IfNot} ${FileExists} "$EXEDIR\${FILE}"
    MessageBox MB_ICONSTOP "Part ${NUMBER} of the installer is missing: ${FILE}.$\n$\nKeep all the files of the download together in one folder and run the setup again." /SD IDOK
    Call RemoveInstalled
    SetErrorLevel 3
    Abort "Missing ${FILE}"
  ${EndIf}
  DetailPrint "Installing part ${NUMBER} of ${COUNT} (${SIZE})..."
  ClearErrors
  ExecWait '"$EXEDIR\${FILE}" /S /FROMSETUP /D=$INSTDIR' $0
  ${If} ${Errors}
  ${OrIf} $0 != 0
    MessageBox MB_ICONSTOP "Part ${NUMBER} of the installer (${FILE}) failed (code $0). The download may be damaged: download it again." /SD IDOK
    Call RemoveInstalled
    SetErrorLevel 4
    Abort "Part ${NUMBER} failed"
  ${EndIf}
!macroend

Section "vramguard (required)" SecCore
  SectionIn RO
  !insertmacro StopRunning
  ; An older version: let its own uninstaller remove its files (it knows them), keeping
  ; the user's settings, cache and logs.
  ${If} ${FileExists} "$INSTDIR\uninstall.exe"
    DetailPrint "Removing the previous version..."
    ExecWait '"$INSTDIR\uninstall.exe" /S /KEEPDATA _?=$INSTDIR'
    Delete "$INSTDIR\uninstall.exe"
  ${EndIf}
  !include "${GEN}/core-files.nsh"
  !include "${GEN}/parts.nsh"
  SetOutPath "$INSTDIR"
  WriteUninstaller "$INSTDIR\uninstall.exe"
  CreateShortcut "${SHORTCUT}" "$INSTDIR\${EXE_DESKTOP}" "" "$INSTDIR\${EXE_DESKTOP}" 0
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "vramguard"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "vramguard"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayIcon" "$INSTDIR\${EXE_DESKTOP}"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" ${SIZE_KB}
SectionEnd

Section /o "Start vramguard when I sign in" SecAutostart
  WriteRegStr HKCU "${RUN_KEY}" "vramguard" '"$INSTDIR\${EXE_DESKTOP}"'
SectionEnd

Function .onInit
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/AUTOSTART" $R1
  ${IfNot} ${Errors}
    !insertmacro SelectSection ${SecAutostart}
  ${EndIf}
FunctionEnd

Section "Uninstall"
  !insertmacro StopRunning
  Call un.RemoveInstalled
  Delete "$INSTDIR\uninstall.exe"
  RMDir "$INSTDIR"
  Delete "${SHORTCUT}"
  DeleteRegValue HKCU "${RUN_KEY}" "vramguard"
  DeleteRegKey HKCU "${UNINST_KEY}"
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/KEEPDATA" $R1
  ${IfNot} ${Errors}
    Return
  ${EndIf}
  ClearErrors
  ${GetOptions} $R0 "/REMOVEDATA" $R1
  ${If} ${Errors}
    MessageBox MB_YESNO|MB_ICONQUESTION "Also remove your vramguard settings, admin token, saved results and logs?$\n$\nKeep them if you plan to install vramguard again." /SD IDNO IDYES remove
    Return
  ${EndIf}
  remove:
  DetailPrint "Removing settings, cache and logs in ${DATA_DIR}"
  RMDir /r "${DATA_DIR}"
SectionEnd
