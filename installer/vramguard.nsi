; vramguard per-user installer (no administrator rights needed).
; Compiled by installer/build_installer.py, which generates the included file lists
; (in ${GEN}) from the PyInstaller bundle and passes VERSION, OUTFILE, EXE_CONSOLE,
; EXE_DESKTOP, SIZE_KB and COMPRESSOR. NSIS cannot hold much more than 2 GB, so the
; bundle is split: this setup carries the first part and runs the other parts
; (vramguard-<version>-setup.partN.bin, shipped beside it) silently into the same folder.
;
; Silent use:  setup.exe /S [/AUTOSTART | /NOAUTOSTART] [/D=folder]
;              (neither: start at login stays as it was; off on a first install)
;              uninstall.exe /S [/REMOVEDATA]   (default: keep settings, cache and logs)

Unicode true
; x86: the official Windows NSIS ships no other stubs ("Unable to set target architecture"
; for amd64). A 32-bit per-user installer loses nothing: WOW64 redirects neither
; %LOCALAPPDATA%, the Start menu, nor HKCU's Uninstall and Run keys.
Target x86-unicode
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
!include "${__FILEDIR__}/progress.nsh"

!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\vramguard"
!define RUN_KEY "Software\Microsoft\Windows\CurrentVersion\Run"
!define DATA_DIR "$LOCALAPPDATA\vramguard"
!define SHORTCUT "$SMPROGRAMS\vramguard.lnk"
; Files still in use when they had to go are moved here (see RemoveFile).
!define ASIDE "$INSTDIR\_pending-delete"
Var StillInUse  ; 1 when a file could be neither deleted nor moved aside

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

; Stop a running vramguard so its files can be replaced or removed. `stop` exits 1 when
; a server did not stop (the tray may have started it again): ask again, twice. What
; still runs after that keeps its files busy; RemoveFile deals with them. Nothing to
; stop, or no old copy to ask ("error": it cannot be started), is fine.
!macro StopRunning
  !ifdef STOP_WITH_CONSOLE
  ${If} ${FileExists} "$INSTDIR\${EXE_CONSOLE}"
    DetailPrint "Closing vramguard if it is running..."
    ${For} $R8 1 3
      ${If} $R8 > 1
        DetailPrint "vramguard has not closed yet; trying again..."
        Sleep 2000
      ${EndIf}
      nsExec::ExecToLog '"$INSTDIR\${EXE_CONSOLE}" stop --timeout-s 30'
      Pop $R9
      ${If} $R9 == 0
      ${OrIf} $R9 == "error"
        ${ExitFor}
      ${EndIf}
    ${Next}
    ${If} $R9 != 0
    ${AndIf} $R9 != "error"
      DetailPrint "vramguard did not close. Files it still uses will be set aside."
    ${EndIf}
  ${EndIf}
  !endif
!macroend

; Delete one installed file (its full path on the stack). Windows refuses to delete a
; program or DLL that is running, but lets it be renamed: such a file is moved into
; ${ASIDE}, so that its name is free for a new version, and the next install or
; uninstall deletes it. (Delete /REBOOTOK would need administrator rights.)
!macro RemoveFileFunction UN
Function ${UN}RemoveFile
  Exch $0
  Push $1
  ClearErrors
  Delete $0
  ${If} ${Errors}
    CreateDirectory "${ASIDE}"
    ClearErrors
    GetTempFileName $1 "${ASIDE}"
    Delete $1
    Rename $0 $1
    ${If} ${Errors}
      DetailPrint "Could not remove $0: it is in use."
      StrCpy $StillInUse 1
    ${Else}
      DetailPrint "In use, set aside to be deleted later: $0"
    ${EndIf}
  ${EndIf}
  Pop $1
  Pop $0
FunctionEnd
!macroend
!insertmacro RemoveFileFunction ""
!insertmacro RemoveFileFunction "un."

; What the generated remove-files.nsh calls for each file.
!macro RemoveFile PATH
  Push "$INSTDIR\${PATH}"
  !ifdef __UNINSTALL__
    Call un.RemoveFile
  !else
    Call RemoveFile
  !endif
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

; Tell the user when files in use were left behind: set aside (this run or an earlier
; one), or, rarely, not even that (a file opened without sharing, say by a virus scanner).
!macro TellAboutFilesInUse MESSAGE
  RMDir "${ASIDE}"  ; only if empty
  ${If} ${FileExists} "${ASIDE}\*.*"
  ${OrIf} $StillInUse = 1
    DetailPrint "Some files were in use and are left for later."
    MessageBox MB_ICONINFORMATION "${MESSAGE}" /SD IDOK
  ${EndIf}
!macroend

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
  ExecWait '"$EXEDIR\${FILE}" /S /FROMSETUP /PROGRESSBAR=$ProgressBar /D=$INSTDIR' $0
  ${If} ${Errors}
  ${OrIf} $0 != 0
    MessageBox MB_ICONSTOP "Part ${NUMBER} of the installer (${FILE}) failed (code $0). The download may be damaged: download it again." /SD IDOK
    Call RemoveInstalled
    SetErrorLevel 4
    Abort "Part ${NUMBER} failed"
  ${EndIf}
!macroend

; The sections only mark what was chosen; Install does the work. NSIS moves the progress
; bar after every instruction of a section, by instruction count: with one instruction
; here, the bar is moved by bytes written alone (progress.nsh), parts included.
Section "vramguard (required)" SecCore
  SectionIn RO
  AddSize ${SIZE_KB}  ; its files are in Install, where NSIS does not count them
  Call Install
SectionEnd

Section /o "Start vramguard when I sign in" SecAutostart
SectionEnd

Function Install
  ${If} ${Silent}
    StrCpy $ProgressBar 0
  ${Else}
    FindWindow $0 "#32770" "" $HWNDPARENT
    GetDlgItem $ProgressBar $0 1004  ; the install page's progress bar
  ${EndIf}
  !insertmacro StopRunning
  RMDir /r "${ASIDE}"  ; files set aside last time, no longer in use now
  ; An older version: let its own uninstaller remove its files (it knows them), keeping
  ; the user's settings, cache and logs.
  ${If} ${FileExists} "$INSTDIR\uninstall.exe"
    DetailPrint "Removing the previous version..."
    ExecWait '"$INSTDIR\uninstall.exe" /S /KEEPDATA _?=$INSTDIR'
    Delete "$INSTDIR\uninstall.exe"
  ${EndIf}
  ; Whatever still holds a name this version writes (a file in use that an older
  ; uninstaller could only leave where it was) is set aside.
  Call RemoveInstalled
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
  ${If} ${SectionIsSelected} ${SecAutostart}
    WriteRegStr HKCU "${RUN_KEY}" "vramguard" '"$INSTDIR\${EXE_DESKTOP}"'
  ${Else}
    DeleteRegValue HKCU "${RUN_KEY}" "vramguard"
  ${EndIf}
  !insertmacro TellAboutFilesInUse "vramguard could not be closed, so some files of the previous version were still in use. Restart your computer to finish.$\n$\nThose files were moved to $\"${ASIDE}$\". The next install or uninstall of vramguard deletes them, or you can delete that folder yourself after the restart."
FunctionEnd

Function .onInit
  ; Start at login stays as the user had it. An upgrade's old uninstaller deletes the Run
  ; value, so it is read now, before that; /AUTOSTART and /NOAUTOSTART change it.
  ReadRegStr $R1 HKCU "${RUN_KEY}" "vramguard"
  ${If} $R1 != ""
    !insertmacro SelectSection ${SecAutostart}
  ${EndIf}
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/AUTOSTART" $R1
  ${IfNot} ${Errors}
    !insertmacro SelectSection ${SecAutostart}
  ${EndIf}
  ClearErrors
  ${GetOptions} $R0 "/NOAUTOSTART" $R1
  ${IfNot} ${Errors}
    !insertmacro UnselectSection ${SecAutostart}
  ${EndIf}
FunctionEnd

Section "Uninstall"
  !insertmacro StopRunning
  RMDir /r "${ASIDE}"  ; files set aside last time, no longer in use now
  Call un.RemoveInstalled
  Delete "$INSTDIR\uninstall.exe"
  Delete "${SHORTCUT}"
  DeleteRegValue HKCU "${RUN_KEY}" "vramguard"
  DeleteRegKey HKCU "${UNINST_KEY}"
  !insertmacro TellAboutFilesInUse "vramguard could not be closed, so some of its files were still in use and could not be deleted yet. They are in $\"$INSTDIR$\".$\n$\nRestart your computer, then delete them (installing and uninstalling vramguard again also deletes them)."
  RMDir "$INSTDIR"
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
